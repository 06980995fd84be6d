"""`python -m fusedlayers bench --framework jax --model bert-base|llama`: training steps of Keras
models on Keras' JAX backend, the model of stock Keras layers against its fused form, both
compiled by XLA as Keras always does on JAX.

bert-base: a BERT-base-shaped encoder (Devlin et al. 2018): token and position embeddings, 12
post-LN blocks of width 768 (12-head self-attention, Keras' MultiHeadAttention; a 3072-wide
erf-GELU MLP), LayerNorm epsilon 1e-12, sequence 512, no dropout; fused by
`fusedlayers.keras.fuse` (its LayerNormalizations and Dense(gelu) layers as fusedlayers' custom
calls).

llama: 4 decoder blocks of Llama-3.2-1B's shape (Dubey et al. 2024): width 2048, pre-RMSNorm
(epsilon 1e-5), causal self-attention with 32 query and 8 key/value heads of 64 and rotary
position embeddings on q and k (KerasHub's formula), a 5632-wide SwiGLU MLP, sequence 2048. The
unfused model computes the rotation and silu(gate) * up in keras.ops; the fused one is built
with fusedlayers.keras.RotaryEmbedding and GatedMLP (the same weights) and passed through
`fusedlayers.keras.fuse` for its RMSNormalizations.

llama-lm / llama-lm-128k: a ~1.1B Llama language model as the torch bench's (16 such blocks,
vocabularies 32000 / 128256, 4 x 2048 tokens) trained on its own next-token loss: the unfused
model's head is a Dense layer whose logits Keras' sparse categorical cross-entropy reads
(materialized); the fused one runs every residual add inside the next norm (AddRMSNorm, the
blocks' adds across blocks included), SwiGLU, RoPE, and the head and loss as one
LinearCrossEntropy; the head's weight transposed from the Dense kernel. The first forward's
losses are compared.

With fp8 (`--fp8`, the Llama models) the fused model also with its attention and MLP
projections as fusedlayers.keras.Fp8Dense (GatedMLP(recipe=)), blockwise and tensorwise, a row
each; the head stays in the compute dtype.

`tiny` shrinks each to 2 blocks of width 64 for a quick run on the CPU. Mixed precision as
Keras' "mixed_bfloat16" policy (bfloat16 compute, float32 variables) or float32. A step is
`model.fit` on one batch: forward, the mean square of the last hidden state, backward, AdamW.

Unfused and fused run interleaved in A/B rounds (ABBA order), each a `fit` of `steps` batches
whose wall time ends when fit returns its logs (so the device work is done); the median over the
rounds is reported. The first forward of both, on the same input, is compared:
||fused - unfused|| / ||unfused||; and the fused model's compiled step is checked to call the
fused kernels.
"""

import json
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass

from .table import did_not_run, out_of_memory

CONFIGS = {"bert-base": dict(blocks=12, width=768, heads=12, mlp=3072, vocab=30522, seq=512),
           "bert-base-tiny": dict(blocks=2, width=64, heads=4, mlp=256, vocab=1000, seq=64),
           "llama": dict(blocks=4, width=2048, heads=32, kv_heads=8, mlp=5632, vocab=32000,
                         seq=2048),
           "llama-tiny": dict(blocks=2, width=64, heads=4, kv_heads=2, mlp=160, vocab=1000,
                              seq=64),
           "llama-lm": dict(blocks=16, width=2048, heads=32, kv_heads=8, mlp=5632, vocab=32000,
                            seq=2048),
           "llama-lm-128k": dict(blocks=16, width=2048, heads=32, kv_heads=8, mlp=5632,
                                 vocab=128256, seq=2048)}
CONFIGS["llama-lm-tiny"] = CONFIGS["llama-lm-128k-tiny"] = CONFIGS["llama-tiny"]
# The custom calls each fused model's compiled forward must contain.
_LM_OPS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "linear_cross_entropy")
FUSED_OPS = {"bert-base": ("layer_norm", "linear_gelu"), "llama": ("rms_norm", "swiglu", "rope"),
             "llama-lm": _LM_OPS, "llama-lm-128k": _LM_OPS}
DEFAULT_BATCHES = {"bert-base": {"gpu": (16, 32), "cpu": (4,)},
                   "llama": {"gpu": (2, 4), "cpu": (4,)},
                   "llama-lm": {"gpu": (4,), "cpu": (2,)}, "llama-lm-128k": {"gpu": (4,), "cpu": (2,)}}
HEADER = (f"{'model':<28}{'batch':>6} {'precision':<15}{'unfused ms':>11}{'fused ms':>10}"
          f"{'speedup':>9}{'1st fwd diff':>14}")


@dataclass
class KerasModelRow:
    model: str
    batch: int
    precision: str  # "mixed_bfloat16" or "float32"
    unfused_ms: float | None  # None where a model did not run
    fused_ms: float | None
    speedup: float | None  # unfused_ms / fused_ms
    first_forward_rel_diff: float | None
    not_run: str = ""  # which model did not run, and why


def _keras():
    """Keras on its JAX backend (Keras picks its backend once, at import)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    if keras.backend.backend() != "jax":
        raise RuntimeError(f"the Keras model bench runs on Keras' JAX backend; Keras was imported "
                           f"with {keras.backend.backend()!r} (set KERAS_BACKEND=jax)")
    return keras


def build_bert(blocks: int, width: int, heads: int, mlp: int, vocab: int, seq: int):
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


def build_llama(blocks: int, width: int, heads: int, kv_heads: int, mlp: int, vocab: int,
                seq: int, fused: bool = False, lm: bool = False, fp8=None):
    """Llama decoder blocks as a functional keras.Model from token ids (batch, seq) int32 to the
    last normalized hidden state (batch, seq, width): with keras.ops' rotation and SwiGLU, or
    (fused) fusedlayers.keras's layers, their weights created in the same order. lm: from token
    ids and labels to the mean next-token loss (the module docstring). fp8 (a
    fusedlayers.Fp8Recipe, with fused): the projections as Fp8Dense with that recipe."""
    import functools

    keras = _keras()
    from keras import layers, ops

    import fusedlayers.keras as flk
    Dense = functools.partial(flk.Fp8Dense, recipe=fp8) if fp8 else layers.Dense

    class UnfusedRotaryEmbedding(flk.RotaryEmbedding):
        """KerasHub's rotation of (batch, seq, heads, dim) in keras.ops."""

        def call(self, x):
            cos, sin = (t[:, :, None] for t in self._cos_sin(x.shape[1], x.shape[-1], 0, None))
            x1, x2 = ops.split(x, 2, axis=-1)
            return x * cos + ops.concatenate([-x2, x1], axis=-1) * sin

    class UnfusedGatedMLP(flk.GatedMLP):
        def call(self, x):
            return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))

    class Attention(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            dense = dict(use_bias=False, dtype=self.dtype_policy)
            self.q_proj = Dense(heads * (width // heads), **dense)
            self.k_proj = Dense(kv_heads * (width // heads), **dense)
            self.v_proj = Dense(kv_heads * (width // heads), **dense)
            self.o_proj = Dense(width, **dense)
            self.rotary = (flk.RotaryEmbedding if fused else UnfusedRotaryEmbedding)(
                max_wavelength=500000, dtype=self.dtype_policy)

        def build(self, shape):
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                proj.build(shape)
            self.o_proj.build(shape)

        def call(self, x):
            b, s = ops.shape(x)[:2]
            q, k, v = (ops.reshape(proj(x), (b, s, n, width // heads)) for proj, n in
                       ((self.q_proj, heads), (self.k_proj, kv_heads), (self.v_proj, kv_heads)))
            y = ops.dot_product_attention(self.rotary(q), self.rotary(k), v, is_causal=True)
            return self.o_proj(ops.reshape(y, (b, s, width)))

    ids = keras.Input((seq,), dtype="int32")
    x = layers.Embedding(vocab, width)(ids)
    if lm and fused:  # each add inside the norm after it; the same weights in the same order
        y = flk.RMSNorm(epsilon=1e-5)(x)
        for _ in range(blocks):
            y, x = flk.AddRMSNorm(epsilon=1e-5)(Attention()(y), x)
            y, x = flk.AddRMSNorm(epsilon=1e-5)(flk.GatedMLP(mlp, recipe=fp8)(y), x)
        labels = keras.Input((seq,), dtype="int32")
        return keras.Model([ids, labels], flk.LinearCrossEntropy(vocab)(y, labels))
    for _ in range(blocks):
        x = x + Attention()(layers.RMSNormalization(epsilon=1e-5)(x))
        mlp_layer = flk.GatedMLP(mlp, recipe=fp8) if fused else UnfusedGatedMLP(mlp)
        x = x + mlp_layer(layers.RMSNormalization(epsilon=1e-5)(x))
    y = layers.RMSNormalization(epsilon=1e-5)(x)
    return keras.Model(ids, layers.Dense(vocab, use_bias=False)(y) if lm else y)


def _models(name: str, config: dict, fp8=None):
    """(unfused, fused) with the same weights; fp8: build_llama's."""
    import fusedlayers.keras as flk
    if name == "bert-base":
        unfused = build_bert(**config)
        return unfused, flk.fuse(unfused)
    lm = name.startswith("llama-lm")
    unfused = build_llama(**config, lm=lm)
    fused = build_llama(**config, fused=True, lm=lm, fp8=fp8)
    fused = fused if lm else flk.fuse(fused)
    weights = unfused.get_weights()
    if lm:  # the head: a Dense kernel (width, vocab), LinearCrossEntropy's (vocab, width)
        weights[-1] = weights[-1].T
    fused.set_weights(weights)
    return unfused, fused


def _compile(model, lm: bool, fused: bool):
    """AdamW on the mean square of the last hidden state, or (lm) on the loss: Keras' sparse
    categorical cross-entropy of the logits, or the fused model's own (added) loss."""
    keras = _keras()
    if lm:
        loss = None if fused else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        def loss(_, y):
            return keras.ops.mean(keras.ops.square(keras.ops.cast(y, "float32")))
    model.compile(optimizer=keras.optimizers.AdamW(1e-4), loss=loss)


def run(name: str, batches, precisions, rounds: int, steps: int, tiny: bool = False,
        variants=("",), log=print, fp8: bool = False) -> list[KerasModelRow]:
    """variants: FUSEDLAYERS_JAX_IMPL settings (fusedlayers.jax._impl) the fused model is traced
    under, one row each ("" for the defaults), each timed in A/B rounds against the unfused
    model; fp8 (the Llama models): also a row for the fused model in FP8 with each recipe, under
    the defaults."""
    keras = _keras()
    import jax
    import numpy as np

    from ..fp8_recipe import Fp8Recipe

    if name not in FUSED_OPS:
        raise ValueError(f"the Keras model bench's model must be one of "
                         f"{', '.join(FUSED_OPS)}, got {name!r}")
    cases = [(v, None) for v in variants] + [
        ("", Fp8Recipe(s)) for s in ("blockwise", "tensorwise") if fp8 and name != "bert-base"]
    config = CONFIGS[f"{name}-tiny" if tiny else name]
    gpu = jax.devices()[0].platform == "gpu"
    lm = name.startswith("llama-lm")
    rows = []
    for precision in precisions:
        keras.mixed_precision.set_global_policy(precision)
        for batch in batches or DEFAULT_BATCHES[name]["gpu" if gpu else "cpu"]:
            rng = np.random.default_rng(0)
            ids = rng.integers(0, config["vocab"], (steps * batch, config["seq"]), np.int32)
            if lm:  # next-token labels of random text
                labels = rng.integers(0, config["vocab"], ids.shape, np.int32)
                inputs = {"unfused": (ids, labels), "fused": ([ids, labels], None)}
            else:
                target = np.zeros((steps * batch, 1), np.float32)  # the loss ignores it
                inputs = {"unfused": (ids, target), "fused": (ids, target)}
            unfused, unfused_error = None, None
            for variant, recipe in cases:
                keras.utils.set_random_seed(0)
                previous = os.environ.get("FUSEDLAYERS_JAX_IMPL")
                os.environ["FUSEDLAYERS_JAX_IMPL"] = variant
                label = (name if not tiny else f"{name}-tiny") + (
                    f" [{variant}]" if variant else "") + (f" fp8 {recipe.scaling}" if recipe
                                                           else "")
                key = "unfused"
                try:
                    built, fused = _models(name, config, recipe)  # the same initial weights
                    diff = _first_forward_diff(built, fused, lm, ids[:batch],
                                               labels[:batch] if lm else None)
                    if unfused is None and unfused_error is None:
                        try:
                            _compile(built, lm, False)
                            built.fit(*inputs["unfused"], batch_size=batch, epochs=1,
                                      verbose=0)
                            unfused = built
                        except Exception as e:  # noqa: BLE001 (out of memory: the row says so)
                            if not out_of_memory(e):
                                raise
                            unfused_error = did_not_run(e)
                    key = "fused"
                    _check_program(name, fused, variant, lm, ids[:batch],
                                   labels[:batch] if lm else None, fp8=recipe is not None)
                    _compile(fused, lm, True)
                    fused.fit(*inputs["fused"], batch_size=batch, epochs=1, verbose=0)  # traced
                except Exception as e:  # noqa: BLE001 (out of memory: the row says so)
                    if not out_of_memory(e):
                        raise
                    rows.append(KerasModelRow(label, batch, precision, None, None, None, None,
                                              f"{key} did not run: {did_not_run(e)}"))
                    log(format_row(rows[-1]))
                    continue
                finally:
                    if previous is None:
                        os.environ.pop("FUSEDLAYERS_JAX_IMPL")
                    else:
                        os.environ["FUSEDLAYERS_JAX_IMPL"] = previous
                if unfused_error is not None:
                    rows.append(KerasModelRow(label, batch, precision, None, None, None, diff,
                                              f"unfused did not run: {unfused_error}"))
                    log(format_row(rows[-1]))
                    continue
                times = {"unfused": [], "fused": []}
                for r in range(rounds):
                    order = (("unfused", unfused), ("fused", fused))
                    for key, model in order if r % 2 == 0 else order[::-1]:
                        start = time.perf_counter()
                        model.fit(*inputs[key], batch_size=batch, epochs=1, verbose=0)
                        times[key].append(1e3 * (time.perf_counter() - start) / steps)
                u, f = (statistics.median(times[k]) for k in ("unfused", "fused"))
                row = KerasModelRow(label, batch, precision, u, f, u / f, diff)
                log(format_row(row))
                rows.append(row)
                del fused
    keras.mixed_precision.set_global_policy("float32")
    return rows


def _first_forward_diff(unfused, fused, lm: bool, ids, labels) -> float:
    """||fused - unfused|| / ||unfused|| of the first forward: the last hidden state, or (lm) the
    loss."""
    keras = _keras()
    import numpy as np
    if lm:
        a = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            labels, unfused(ids)))
        return abs(float(fused([ids, labels])) - a) / abs(a)
    a, b = (np.asarray(m(ids), np.float64) for m in (unfused, fused))
    return float(np.linalg.norm(b - a) / np.linalg.norm(a))


def _check_program(name: str, fused, variant: str, lm: bool, ids, labels,
                   fp8: bool = False) -> None:
    """The fused model's program calls fusedlayers' kernels (those the variant leaves; with fp8
    the FP8 quantization and GEMM too)."""
    import jax
    lowered = (jax.jit(lambda x, t: fused([x, t])).lower(ids, labels) if lm
               else jax.jit(lambda x: fused(x)).lower(ids)).as_text()
    xla = {item.split("=")[0] for item in variant.split(",") if item.endswith("=xla")}
    missing = [op for op in FUSED_OPS[name] + (("fp8_quantize", "fp8_gemm") if fp8 else ())
               if op not in xla and not re.search(rf"fusedlayers_{op}(?![a-z0-9])", lowered)]
    if missing:
        raise RuntimeError(f"the fused model's program does not call fusedlayers' kernels "
                           f"{missing}:\n{getattr(fused, 'fusedlayers_report', '')}")


def format_row(r: KerasModelRow) -> str:
    lead = f"{r.model:<28}{r.batch:>6} {r.precision:<15}"
    if r.not_run:
        return lead + r.not_run
    return (f"{lead}{r.unfused_ms:>11.2f}{r.fused_ms:>10.2f}{r.speedup:>8.2f}x"
            f"{r.first_forward_rel_diff:>14.1e}")


def write_json(path: str, rows: list[KerasModelRow], device: str) -> None:
    with open(path, "w") as f:
        json.dump({"device": device, "rows": [asdict(r) for r in rows]}, f, indent=1)
