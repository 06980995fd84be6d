"""`python -m fusedlayers bench --framework jax --model llama-lm|llama-lm-128k`, its Flax NNX
rows: the ~1.1B Llama language model of the Keras rows (fusedlayers.bench.keras_models: 16
blocks of width 2048, GQA 32/8 heads of 64 with rotary embeddings, a 5632-wide SwiGLU MLP,
pre-RMSNorm, vocabularies 32000 / 128256, 4 x 2048 tokens) in Flax NNX, bfloat16 computation
with float32 parameters, a training step under `jax.jit`: the mean next-token loss, its
gradient, optax's AdamW.

Unfused: flax.nnx's RMSNorm and Linear layers, the rotation and silu(gate) * up in jnp, the
logits of the head and optax's `softmax_cross_entropy_with_integer_labels` on them (float32).
Fused, the same parameters (one state tree): fusedlayers.flax's RMSNorm, every residual add in
the next norm (AddRMSNorm, across blocks too), RotaryEmbedding, GatedMLP and LinearCrossEntropy.
Attention is `jax.nn.dot_product_attention` in both (cuDNN's on GPUs). One model at a time (two with their
optimizer states do not fit with the unfused logits), `rounds` runs of `steps` steps, median ms
per step (the loss of the last step waited for); the step's XLA temp buffer (activations and
workspace, `memory_analysis` of the compiled step) in MB; the first losses compared."""

import statistics
import time

CONFIGS = {"llama-lm": dict(blocks=16, width=2048, heads=32, kv_heads=8, mlp=5632, vocab=32000,
                            seq=2048),
           "llama-lm-128k": dict(blocks=16, width=2048, heads=32, kv_heads=8, mlp=5632,
                                 vocab=128256, seq=2048),
           "tiny": dict(blocks=2, width=64, heads=4, kv_heads=2, mlp=160, vocab=1000, seq=64)}


def build(blocks: int, width: int, heads: int, kv_heads: int, mlp: int, vocab: int, seq: int,
          fused: bool, seed: int = 0):
    """The model (an nnx.Module whose __call__(ids, labels) is the mean loss), its parameters
    drawn from `seed` in the same order fused or not."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import fusedlayers.flax as flf
    bf16, dim = jnp.bfloat16, width // heads
    # cuDNN's fused attention on GPUs (XLA's keeps every layer's probabilities for the backward)
    attention = "cudnn" if jax.devices()[0].platform == "gpu" else None
    linear = dict(use_bias=False, dtype=bf16, param_dtype=jnp.float32)

    def rotate(x):  # (batch, seq, heads, dim), Llama's rotate_half
        inv = 1.0 / 500000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
        freq = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv
        angles = jnp.concatenate([freq, freq], -1)[None, :, None]
        cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
        return x * cos + jnp.concatenate([-x[..., dim // 2:], x[..., :dim // 2]], -1) * sin

    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.q_proj = nnx.Linear(width, heads * dim, rngs=rngs, **linear)
            self.k_proj = nnx.Linear(width, kv_heads * dim, rngs=rngs, **linear)
            self.v_proj = nnx.Linear(width, kv_heads * dim, rngs=rngs, **linear)
            self.o_proj = nnx.Linear(heads * dim, width, rngs=rngs, **linear)
            self.rotary = flf.RotaryEmbedding(500000) if fused else None

        def __call__(self, x):
            b, s = x.shape[:2]
            q, k, v = (p(x).reshape(b, s, n, dim) for p, n in
                       ((self.q_proj, heads), (self.k_proj, kv_heads), (self.v_proj, kv_heads)))
            q, k = (self.rotary(q), self.rotary(k)) if fused else (rotate(q), rotate(k))
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
            return self.o_proj(y.reshape(b, s, heads * dim))

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.gate_proj = nnx.Linear(width, mlp, rngs=rngs, **linear)
            self.up_proj = nnx.Linear(width, mlp, rngs=rngs, **linear)
            self.down_proj = nnx.Linear(mlp, width, rngs=rngs, **linear)

        def __call__(self, x):
            return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))

    def norm(first: bool, rngs):
        cls = nnx.RMSNorm if not fused else flf.RMSNorm if first else flf.AddRMSNorm
        return cls(width, epsilon=1e-5, dtype=bf16, param_dtype=jnp.float32, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, first, rngs):
            self.attn_norm, self.attn = norm(first, rngs), Attention(rngs)
            self.mlp_norm = norm(False, rngs)
            self.mlp = flf.GatedMLP(width, mlp, dtype=bf16, rngs=rngs) if fused else MLP(rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, width, dtype=bf16, param_dtype=jnp.float32, rngs=rngs)
            # nnx.List where flax has it (0.12: a plain list of modules is not a pytree of them)
            self.layers = getattr(nnx, "List", list)([Block(i == 0, rngs)
                                                      for i in range(blocks)])
            self.final_norm = norm(False, rngs)
            if fused:
                self.head = flf.LinearCrossEntropy(width, vocab, dtype=bf16, rngs=rngs)
            else:
                self.head = nnx.Module()
                self.head.kernel = nnx.Param(nnx.initializers.lecun_normal()(
                    rngs.params(), (vocab, width), jnp.float32))

        def __call__(self, ids, labels):
            h = self.embed(ids)
            if not fused:
                for layer in self.layers:
                    h = h + layer.attn(layer.attn_norm(h))
                    h = h + layer.mlp(layer.mlp_norm(h))
                y = self.final_norm(h)
                logits = y @ self.head.kernel[...].astype(bf16).T
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits.astype(jnp.float32), labels).mean()
            y = self.layers[0].attn_norm(h)
            for i, layer in enumerate(self.layers):
                y, h = layer.mlp_norm(layer.attn(y), h)
                after = self.layers[i + 1].attn_norm if i + 1 < blocks else self.final_norm
                y, h = after(layer.mlp(y), h)
            return self.head(y, labels)

    return Model(nnx.Rngs(seed))


def _train_step(model):
    """(step, state): step(state, ids, labels) -> (state, loss), jitted with the state donated."""
    import jax
    import optax
    from flax import nnx

    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, ids, labels):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: m(ids, labels))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss
    return jax.jit(step, donate_argnums=0), state


def run(name: str, batch: int, rounds: int, steps: int, tiny: bool = False, log=print):
    """Rows (label, unfused ms, fused ms, speedup, unfused temp MB, fused temp MB, loss diff)."""
    import jax
    import numpy as np

    config = CONFIGS["tiny" if tiny else name]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config["vocab"], (batch, config["seq"]), np.int32)
    labels = rng.integers(0, config["vocab"], ids.shape, np.int32)
    first, times, temp = {}, {}, {}
    # One model at a time: two with their AdamW states and the unfused step's logits do not
    # fit an 80 GB device at vocabulary 128256, so the rows are sequential, not A/B rounds.
    for key in ("unfused", "fused"):
        model = build(**config, fused=key == "fused")
        first[key] = float(model(ids, labels))
        step, state = _train_step(model)
        del model
        temp[key] = step.lower(state, ids, labels).compile().memory_analysis() \
            .temp_size_in_bytes / 2 ** 20
        state, loss = step(state, ids, labels)  # compile, warm
        loss.block_until_ready()
        times[key] = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(steps):
                state, loss = step(state, ids, labels)
            loss.block_until_ready()
            times[key].append(1e3 * (time.perf_counter() - start) / steps)
        del state, step
    diff = abs(first["fused"] - first["unfused"]) / abs(first["unfused"])
    u, f = (statistics.median(times[k]) for k in ("unfused", "fused"))
    row = (f"{'flax ' + name + ('-tiny' if tiny else ''):<22}{batch:>6} {'bf16/f32 params':<16}"
           f"{u:>10.2f}{f:>10.2f}{u / f:>8.2f}x{temp['unfused']:>12.0f}{temp['fused']:>10.0f}"
           f"{diff:>12.1e}")
    log(row)
    return row


HEADER = (f"{'model':<22}{'batch':>6} {'precision':<16}{'unfused':>10}{'fused':>10}"
          f"{'speedup':>9}{'temp MB unf':>12}{'fused':>10}{'1st loss':>12}")
