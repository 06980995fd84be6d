"""`python -m fusedlayers bench --framework jax --model bert-base`: training steps of a
BERT-base-shaped Keras encoder on Keras' JAX backend, the model of stock Keras layers against
`fusedlayers.keras.fuse` of it (its LayerNormalizations and Dense(gelu) layers as fusedlayers'
custom calls), both compiled by XLA as Keras always does on JAX.

The encoder is BERT-base's shape (Devlin et al. 2018): token and position embeddings, 12 post-LN
blocks of width 768 (12-head self-attention, Keras' MultiHeadAttention; a 3072-wide erf-GELU MLP),
LayerNorm epsilon 1e-12, sequence 512, no dropout. `tiny` shrinks it to 2 blocks of width 64 for a
quick run on the CPU. Mixed precision as Keras' "mixed_bfloat16" policy (bfloat16 compute,
float32 variables) or float32. A step is `model.fit` on one batch: forward, the mean square of the
last hidden state, backward, AdamW.

Unfused and fused run interleaved in A/B rounds (ABBA order), each a `fit` of `steps` batches
whose wall time ends when fit returns its logs (so the device work is done); the median over the
rounds is reported. The first forward of both, on the same input, is compared:
||fused - unfused|| / ||unfused||; and the fused model's compiled step is checked to call the
fused kernels.
"""

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

CONFIGS = {"bert-base": dict(blocks=12, width=768, heads=12, mlp=3072, vocab=30522, seq=512),
           "tiny": dict(blocks=2, width=64, heads=4, mlp=256, vocab=1000, seq=64)}
DEFAULT_BATCHES = {"gpu": (16, 32), "cpu": (4,)}
HEADER = (f"{'model':<15}{'batch':>6} {'precision':<15}{'unfused ms':>11}{'fused ms':>10}"
          f"{'speedup':>9}{'1st fwd diff':>14}")


@dataclass
class KerasModelRow:
    model: str
    batch: int
    precision: str  # "mixed_bfloat16" or "float32"
    unfused_ms: float
    fused_ms: float
    speedup: float  # unfused_ms / fused_ms
    first_forward_rel_diff: float


def _keras():
    """Keras on its JAX backend (Keras picks its backend once, at import)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    if keras.backend.backend() != "jax":
        raise RuntimeError(f"the Keras model bench runs on Keras' JAX backend; Keras was imported "
                           f"with {keras.backend.backend()!r} (set KERAS_BACKEND=jax)")
    return keras


def build(blocks: int, width: int, heads: int, mlp: int, vocab: int, seq: int):
    """The unfused encoder: a functional keras.Model from token ids (batch, seq) int32 to the
    last hidden state (batch, seq, width)."""
    keras = _keras()
    from keras import layers

    class PositionEmbedding(layers.Layer):
        def build(self, shape):
            self.positions = self.add_weight(shape=tuple(shape[1:]), name="positions")

        def call(self, x):
            return x + keras.ops.cast(self.positions, x.dtype)

    ids = keras.Input((seq,), dtype="int32")
    x = PositionEmbedding()(layers.Embedding(vocab, width)(ids))
    x = layers.LayerNormalization(epsilon=1e-12)(x)
    for _ in range(blocks):
        attention = layers.MultiHeadAttention(heads, width // heads)(x, x)
        x = layers.LayerNormalization(epsilon=1e-12)(x + attention)
        h = layers.Dense(width)(layers.Dense(mlp, activation="gelu")(x))
        x = layers.LayerNormalization(epsilon=1e-12)(x + h)
    return keras.Model(ids, x)


def _compile(model):
    keras = _keras()
    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=lambda _, y: keras.ops.mean(keras.ops.square(
                      keras.ops.cast(y, "float32"))))


def run(name: str, batches, precisions, rounds: int, steps: int, tiny: bool = False,
        log=print) -> list[KerasModelRow]:
    keras = _keras()
    import jax
    import numpy as np

    import fusedlayers.keras as flk
    config = CONFIGS["tiny" if tiny else name]
    gpu = jax.devices()[0].platform == "gpu"
    rows = []
    for precision in precisions:
        keras.mixed_precision.set_global_policy(precision)
        for batch in batches or DEFAULT_BATCHES["gpu" if gpu else "cpu"]:
            keras.utils.set_random_seed(0)
            unfused = build(**config)
            fused = flk.fuse(unfused)
            rng = np.random.default_rng(0)
            ids = rng.integers(0, config["vocab"], (steps * batch, config["seq"]), np.int32)
            target = np.zeros((steps * batch, 1), np.float32)  # the loss ignores it
            a = np.asarray(unfused(ids[:batch]), np.float64)
            b = np.asarray(fused(ids[:batch]), np.float64)
            diff = float(np.linalg.norm(b - a) / np.linalg.norm(a))
            lowered = jax.jit(lambda x: fused(x)).lower(ids[:batch]).as_text()
            if not all(f"fusedlayers_{op}_" in lowered for op in ("layer_norm", "linear_gelu")):
                raise RuntimeError(f"the fused model's program does not call fusedlayers' "
                                   f"kernels:\n{fused.fusedlayers_report}")
            times = {"unfused": [], "fused": []}
            for model in (unfused, fused):
                _compile(model)
                model.fit(ids, target, batch_size=batch, epochs=1, verbose=0)  # compile, warm
            for r in range(rounds):
                order = (("unfused", unfused), ("fused", fused))
                for key, model in order if r % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    model.fit(ids, target, batch_size=batch, epochs=1, verbose=0)
                    times[key].append(1e3 * (time.perf_counter() - start) / steps)
            u, f = (statistics.median(times[k]) for k in ("unfused", "fused"))
            row = KerasModelRow(name if not tiny else f"{name}-tiny", batch, precision, u, f,
                                u / f, diff)
            log(format_row(row))
            rows.append(row)
    keras.mixed_precision.set_global_policy("float32")
    return rows


def format_row(r: KerasModelRow) -> str:
    return (f"{r.model:<15}{r.batch:>6} {r.precision:<15}{r.unfused_ms:>11.2f}{r.fused_ms:>10.2f}"
            f"{r.speedup:>8.2f}x{r.first_forward_rel_diff:>14.1e}")


def write_json(path: str, rows: list[KerasModelRow], device: str) -> None:
    with open(path, "w") as f:
        json.dump({"device": device, "rows": [asdict(r) for r in rows]}, f, indent=1)
